"""`dataset=chat`: conversations for supervised fine-tuning.

`template.py` finds and renders the chat template (transformers' renderer, no torch);
`render.py` derives each token's trained flag by rendering prefix by prefix; `build.py` is the
front end (checks, rendering every row into cached token and mask stores before launch);
`samples.py` (torch) packs or pads them into samples whose loss is the global batch's token mean.
"""
