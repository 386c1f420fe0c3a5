"""Prints the table of the policy file's fields, generated from the model.

    .venv/bin/python scripts/policy_table.py

Paste its output over the table under "Every field" in docs/reference/policy.md;
tests/unit/test_docs.py fails while the reference's table differs from it.
"""

from shardvault.config.policy import fields_table

if __name__ == "__main__":
    print(fields_table(), end="")
