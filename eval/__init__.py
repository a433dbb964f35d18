"""tale-eval: decode-mode quality of TALE against full, KIVI, StreamingLLM and Palu-style caches."""
