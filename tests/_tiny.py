"""The tiny Llama-style [model] block the data tests train (2 layers, d 64, vocab 512, seq 64): one text, shared."""

TINY_MODEL = """
[model]
name = "tiny-llama"
n_layers = 2
d_model = 64
n_heads = 4
n_kv_heads = 2
d_ff = 192
vocab_size = 512
max_seq_len = 64
"""
