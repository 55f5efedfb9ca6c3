"""One parameter's life between steps: its shards, their staging and delivery, gathered blocks, the prefetcher, the module hooks."""
