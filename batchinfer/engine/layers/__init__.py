"""Building blocks of the paged-attention models: attention, linear (tensor-parallel names), rotary, norm."""
