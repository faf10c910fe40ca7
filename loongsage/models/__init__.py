"""Model and tokenizer factories: tiny real-architecture HF models for CPU recipes and tests
(`factory.py`, `tokenizer.py`), and the `model` config section (`config.py`, no torch)."""
