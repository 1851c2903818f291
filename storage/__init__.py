"""Storage: the call record, tables, engines, the on-disk journal and the batch writer."""
