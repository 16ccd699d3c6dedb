"""Graph to pieces: batch symbol, splitting, floats, the compiler adaptor, per-size compiles."""
