"""Checkpoint conversion between Hugging Face and this framework, one tensor table per model
family (MaxText/families/, written with families/tensor_maps.py): hf_to_maxtext.py and maxtext_to_hf.py
are the entry points."""
