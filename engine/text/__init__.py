"""Token ids to text: incremental detokenizing and the offline API's stop strings."""
