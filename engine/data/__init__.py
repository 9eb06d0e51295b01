"""Data pipeline: preprocessing to indexed token files, datasets, blending and DP loading."""
