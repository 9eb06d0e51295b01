"""Equivalence checks: a parallel layout against the unsplit model (``layouts``), and
meshtron's import of a Hugging Face model against transformers (``hf_parity``).

``tools/verify_equivalence.py`` is the command line over both.
"""
