"""Narrow formats: recipes (the vocabulary), FP8 (delayed scaling, ampkit's own), the torchao bridge."""
