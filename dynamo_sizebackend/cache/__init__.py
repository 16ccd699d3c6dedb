"""Compiled pieces kept for reuse: the key (:mod:`.key`) and the store (:mod:`.store`)."""
