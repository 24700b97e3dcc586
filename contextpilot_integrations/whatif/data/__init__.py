"""Bundled data files (MultiHop-RAG sample, ODC-BY 1.0; see README.md here)."""
