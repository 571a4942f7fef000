"""The dataset options (conf/dataset/<name>.yaml), one module or folder each: its schema, checks,
normalization, constants and the `DatasetOption` (loom.data.option) it hands to the registry as
`OPTION`. Nothing outside an option's folder names it or reads its own keys
(tests/test_data_options.py); what options share (common checks, the token machinery, the
Hugging Face loader) lies below them and names none.
"""
