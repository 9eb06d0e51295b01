"""Equivalence checks: a parallel layout against the unsplit model (``layouts``; through
a pipeline ``pipeline_layouts``, with the rows of ``outputs``), and meshtron's import of
a Hugging Face model against transformers (``hf_parity``).

``tools/verify_equivalence.py`` is the command line over both.
"""
