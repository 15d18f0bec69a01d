"""The studies behind the docs: experiments that answer one question each, with the
tools, for a page to quote.

- `large_batch`: the linear scaling rule and warmup, reproduced small;
- `fault_trials`: kill a random worker at a random phase, check the resume;
- `elastic_trials`: lose a node of an elastic run, check that the others go on;
- `grad_view_memory`: what `gradient_as_bucket_view=True` saves;
- `compile_overlap`: when buckets leave under torch.compile.

Nothing below imports them."""
