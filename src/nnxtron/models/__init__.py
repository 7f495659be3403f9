"""Model families (one module each) and their registry."""
