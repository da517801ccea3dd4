"""The tokenizer tests' model dir, tokenizer and ServerArgs fixtures, for the app-level replica tests."""

from tests.tokenizer.conftest import args, model_dir, tok  # noqa: F401
