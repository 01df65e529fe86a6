"""Evaluation: spoken MT-Bench judged by an LLM, with latency figures, against a server or a tandem
session in this process (`harness.py`, `inprocess.py`; the pure parts in `mtbench.py`)."""
