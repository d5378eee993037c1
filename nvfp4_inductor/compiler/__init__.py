"""The torch.compile backend: recognition (match_*.py), rewrite, fused ops, options."""
