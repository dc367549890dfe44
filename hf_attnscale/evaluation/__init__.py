"""Evaluation past the trained length: perplexity by length, streaming, encoders' MLM measures, data."""
