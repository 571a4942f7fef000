"""Conversations rendered with a tokenizer's chat template, shared by the options that render them
(`dataset=chat`, `dataset=preference`): an option may not import another option's modules.

`template.py` finds and renders the chat template (transformers' renderer, no torch); `render.py`
checks messages and derives each token's trained flag from prefix renderings. No torch here.
"""
