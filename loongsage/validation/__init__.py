"""Validated recipes: each recipe's `expect:` bounds (and its `quick:` short form), checked against
the run directory by `loongsage validate`."""
