"""The AWS services a workflow step calls: the store (S3), the tables (DynamoDB), data keys
(KMS), the clients built once per process (``services``), what every Lambda handler shares
(``lambda_support``), a deployed stack's outputs (``stack_outputs``), and reading a backup
back from the store (``readback``, ``materialize``)."""
