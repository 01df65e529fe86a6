"""Test and demo helpers: speech synthesis, scripted fakes of the vendors (LLM, ASR)."""
