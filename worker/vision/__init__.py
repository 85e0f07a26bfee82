"""Vision-language models."""
