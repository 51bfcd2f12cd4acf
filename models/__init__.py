"""Model definitions, weight loading and tokenization."""
