"""Data: NIfTI datasets (:mod:`.datasets`), which files make a case (:mod:`.discovery`), the synthetic phantoms
(:mod:`.phantoms`), how a case becomes tensors (:mod:`.encoding`), where items are cached (:mod:`.cache`) and
volume I/O (:mod:`.volume_io`)."""
