"""The local stack: the AWS deployment on one machine (moto, MinIO, agent processes)."""
