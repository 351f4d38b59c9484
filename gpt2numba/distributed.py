"""The documented path of Ray Data scoring and generation (the optional extra [ray]): integrations/distributed.py."""

from .integrations.distributed import cluster, generate_dataset, read_documents, score_dataset, write  # noqa: F401
