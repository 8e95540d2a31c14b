"""The state slots of linear-attention layers: each running sequence holds one (its conv state and state matrix in
every such layer, kvcache/spec.py StateSpec) from its first scheduled step until it finishes, is aborted or is
preempted (then it recomputes from its first token: a state cannot be cut back to a block boundary)."""


class StateSlots:
    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots

    def take(self, seq) -> int:
        """seq's slot, taken now if it has none."""
        if seq.state_slot is None:
            if not self.free:
                raise RuntimeError(f"all {self.num_slots} state slots are taken: more running sequences than "
                                   "max_num_seqs")
            seq.state_slot = self.free.pop()
        return seq.state_slot

    def release(self, seq):
        if seq.state_slot is not None:
            self.free.append(seq.state_slot)
            seq.state_slot = None

    @property
    def num_free(self) -> int:
        return len(self.free)
