"""Weight transfer between trainers and inference engines (TransferMesh builds on these)."""
