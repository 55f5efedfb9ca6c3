"""Hugging Face weights: streamed into shards at start, written out in the Hugging Face layout at the end."""
