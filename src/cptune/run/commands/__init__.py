"""What the other commands run: evaluation, inference, merging an adapter, and the preprocessing views
(the data report and its page); the weights they load are :mod:`.weights`."""
