"""Checkpoint conversion between Hugging Face and this framework, one mapping per model family
(registry.py): hf_to_maxtext.py and maxtext_to_hf.py are the entry points."""
