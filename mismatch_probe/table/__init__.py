"""The per-token table: rollouts (``rollouts/*.parquet``) and scored token shards
(``tokens/*.parquet``), written and read as Arrow in shards so memory stays bounded. Everything
downstream of scoring reads tokens through here. See ARCHITECTURE.md, "Run directory".
"""
