"""Operations with a PyTorch reference and a Triton kernel behind one dispatch point."""
