"""The defaults `headlab stats` chooses among, torch-free so the CLI builds its options without importing torch."""

DEFAULT_CHUNK = 256  # query rows per chunk: B*H*256*T float32 scores at most live at once
