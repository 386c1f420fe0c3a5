"""IAM on the local stack: every call a deployed role could not make is refused here too.

Terms:

- *grants*: the IAM statements of each *principal* exactly as ``cdk synth`` writes them in the
  template (``grants.json``, exported from the template by :mod:`.template`, and held equal to
  a fresh synth by ``tests/infra``): one principal per Lambda function (``function:<module>``,
  its role's policies), the agents' managed policy (``agent``, with the node's principal
  tags), the operators' (``operator``, the CLI's; ``operator-read-only``) and the stack's
  bucket policies (resource policies);
- *resolution*: the template's references (``Fn::GetAtt``, ``Ref``, ``Fn::Join``) turned into
  the local stack's own ARNs (:mod:`.resolve`);
- a *request*: what AWS authorizes for one API call, an IAM action on a resource ARN with the
  condition keys the call sets (:mod:`.requests`); one call may make several (a copy reads
  its source and writes its target);
- the *gate*: where requests are evaluated (:mod:`.gate`): a botocore hook on each function's
  clients (every call, the store on MinIO included, and every URL it presigns, which S3
  authorizes as its signer) and a WSGI layer in front of moto's server for the agents'
  requests, told apart by their access keys. A refused call fails as AWS fails it:
  ``AccessDenied``.
"""
