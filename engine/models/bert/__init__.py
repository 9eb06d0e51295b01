"""The BERT family: token, position and segment embeddings with a LayerNorm, post-LN
bidirectional layers, the masked-LM and sentence-order heads.

``model`` holds the class and the losses, ``hf`` the Hugging Face name map
(``BertForPreTraining``), ``costs`` the FLOP and parameter terms. The presets are
``configs/model/bert_*.yaml``.
"""

from engine.models.bert.model import BertModel, bert_losses

__all__ = ["BertModel", "bert_losses"]
