"""Text that crossed from the model: made safe to encode wherever it goes next."""


def unicode_text(text: str) -> str:
    """`text` with each lone surrogate replaced by '?' (a Python str may hold one; UTF-8, JSON
    clients, tokenizers and files cannot): what any UTF-8 client could have sent or received."""
    return text.encode("utf-8", "replace").decode("utf-8")
