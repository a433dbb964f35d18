"""What tale-eval's options and presets name, apart from the modules that run them (those import torch), so that
`tale-eval --help` and the option checks start without importing torch and transformers."""

# the named rows of the side-by-side table (tale-eval without --frontier)
NAMED = ("full", "tale-exact", "tale", "kivi2", "kivi4", "quanto4", "hqq4", "streaming", "palu")
# the policy families of --frontier
FAMILIES = ("tale", "kivi", "quanto", "hqq", "streaming", "palu", "less", "tailorkv")
PASSKEY_LENGTHS = {"1k": 4000, "2k": 8000}  # haystack characters (~1K and ~2K SmolLM2 tokens)
PASSKEY_DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# the long-context retrieval task families (retrieval.py)
RETRIEVAL_FAMILIES = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")
