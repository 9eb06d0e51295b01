"""Applications over the training runtime: each builds its layout through engine/config.py,
joins the mesh through engine.bootstrap and reuses the runtime's models, data, DP
strategies and checkpoints; the runtime never imports them.

- ``python -m apps.classify``: the Fashion-MNIST classifier, data (and tensor) parallel.
- ``python -m apps.generate_text`` (or ``tools/generate.py``): text from a trained model.
"""
