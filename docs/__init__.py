"""The documentation's sources that are code: the figures (`python -m docs.figures`)."""
