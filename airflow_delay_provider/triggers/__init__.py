"""Triggers: dispatch in the triggerer, the SQS relay, and due messages as asset events."""
