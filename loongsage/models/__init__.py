"""Model and tokenizer factories: tiny real-architecture HF models for CPU recipes and tests."""
from loongsage.models.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_char_tokenizer
from loongsage.models.factory import TinyModelSpec, build_tiny_model

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_char_tokenizer", "TinyModelSpec", "build_tiny_model"]
