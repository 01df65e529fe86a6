"""Front-end benchmark (same as `kame bench frontend`): ms per frame by batch size.

    python scripts/bench_frontend.py --frontend tiny --batch-sizes 1,4,16
    python scripts/bench_frontend.py --frontend moshi-7b-random --device cuda --batch-sizes 1,8,32,64
"""

import argparse
import sys

from kame.cli import add_frontend_bench_args
from kame.frontend.bench import main_frontend

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_frontend_bench_args(parser)
    sys.exit(main_frontend(parser.parse_args()))
