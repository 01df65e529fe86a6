"""Evaluation: spoken MT-Bench through the server, judged by an LLM, with latency figures."""
