"""A cost model of splitting one diffusion sample's denoising step over GPUs: data, CFG, Ulysses and
ring parallel, combined as `d x c x u x r` GPUs.

Pure arithmetic over a model's counted FLOPs and its attention shape; `benchmarks/parallel.py`
counts the FLOPs of the published transformers and prints what follows. Per denoising step of one
sample, on the `c·u·r` GPUs that hold it:

  compute     (passes / c) · FLOPs per forward / (u·r) / (peak · MFU): Ulysses splits the heads
              (attention / u) and the tokens between attentions (linear layers / u), ring splits the
              sequence (both / r); the small replicated parts (timestep embedding, Wan's 512 text
              tokens' K/V projections) are ignored.
  Ulysses     per attention layer 4 all-to-alls (Q, K, V before, the output after), each sending
              (S/r)·H·D·b·(u-1)/u² bytes from every rank; on the critical path, not overlapped.
  ring        per attention layer r-1 K/V blocks of 2·(S/r)·(H/u)·D·b bytes reach every rank.
              Not overlapped by default: diffusers' ring attention (`TemplatedRingAttention`, what
              this project's sequence parallel runs) all-gathers K and V before its loop over the
              blocks, one collective per layer. With `ring_overlap` (a ring of P2P passes on their
              own stream, as ring-flash-attn does) only what a pass takes beyond the attention of
              the block in hand (4·(S/r)²·(H/u)·D FLOPs) is exposed.
  CFG         one exchange of the velocity per step (velocity elements / (u·r) · b per rank).
  data        no per-step communication.

Bytes move at `link_bytes_per_s` per rank (NVSwitch is non-blocking inside a node, so an
all-to-all is bound by each GPU's own link, not by bisection) plus a fixed latency per collective.
"""

from __future__ import annotations

from dataclasses import dataclass


def latent_tokens(
    height: int,
    width: int,
    frames: int = 1,
    spatial: int = 8,
    temporal: int = 4,
    patch: tuple[int, int, int] = (1, 2, 2),
) -> int:
    """Tokens the transformer sees for one image or video: the VAE's latent (`spatial`x down in
    height and width; a video's `frames` to 1 + (frames - 1) / `temporal` latent frames) cut into
    `patch` (time, height, width) patches. 480x832x81 for Wan: 21 x 30 x 52 = 32760."""
    latent_frames = 1 if frames == 1 else (frames - 1) // temporal + 1
    return (latent_frames // patch[0]) * (height // spatial // patch[1]) * (width // spatial // patch[2])


def analytic_linear_flops(parameters: float, tokens: int) -> float:
    """2 · parameters · tokens: every weight multiplies every token once (an upper bound: adaLN
    modulation weights see one timestep vector, and a dual-stream block's weights see only their
    own stream's tokens)."""
    return 2.0 * parameters * tokens


def analytic_attention_flops(layers: int, width: int, query_tokens: int, key_tokens: int) -> float:
    """4 · L · S_q · S_kv · d: QK^T and PV, each 2·S_q·S_kv·d, in each of `layers` attentions."""
    return 4.0 * layers * query_tokens * key_tokens * width


@dataclass(frozen=True)
class Hardware:
    """One GPU and its link to the others in the node."""

    peak_flops: float  # FLOP/s, bf16 dense (H100 / H800: 989e12)
    mfu: float  # the fraction of peak the transformer's forward reaches
    link_bytes_per_s: float  # what one rank's sent bytes move at in a collective
    collective_latency_s: float  # fixed cost of each collective or ring pass
    memory_bytes: float  # per GPU

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.mfu


@dataclass(frozen=True)
class ModelCost:
    """What the cost model needs of one model at one size (one sample)."""

    name: str
    flops_per_forward: float
    heads: int
    head_dim: int
    attention_layers: int  # attentions over the whole sequence (self or joint; not Wan's cross-attention)
    sequence: int  # tokens those attentions span: image tokens, plus the text tokens where attention is joint
    passes: int  # transformer forwards per denoising step: 2 with CFG (conditional and unconditional)
    velocity_elements: int  # one forward's output, what CFG parallel exchanges
    weight_bytes: float  # resident on every GPU whatever the layout (none of these layouts shards weights)
    activation_bytes_per_token: float  # one block's transient tensors per token of one forward
    bytes_per_element: int = 2  # bf16

    def __post_init__(self) -> None:
        if self.passes not in (1, 2):
            raise ValueError(f"{self.name}: passes is {self.passes}; a step runs 1 forward (no CFG) or 2 (CFG)")


@dataclass(frozen=True)
class Layout:
    """`data` replicas, each of `cfg` x `ulysses` x `ring` GPUs working on one sample."""

    data: int
    cfg: int = 1
    ulysses: int = 1
    ring: int = 1

    @property
    def gpus(self) -> int:
        return self.data * self.per_sample

    @property
    def per_sample(self) -> int:
        return self.cfg * self.ulysses * self.ring

    @property
    def sequence_split(self) -> int:
        return self.ulysses * self.ring

    def __str__(self) -> str:
        return f"d{self.data} c{self.cfg} u{self.ulysses} r{self.ring}"


def layouts(gpus: int, heads: int, passes: int) -> list[Layout]:
    """Every layout of `gpus` GPUs: d·c·u·r = gpus, c = 2 only when a step has two passes to split,
    u dividing the head count (Ulysses gives each rank H/u whole heads). Pure data parallel first."""
    found = []
    for cfg in (1, 2) if passes == 2 else (1,):
        for ulysses in range(1, gpus + 1):
            for ring in range(1, gpus + 1):
                per_sample = cfg * ulysses * ring
                if gpus % per_sample or heads % ulysses:
                    continue
                found.append(Layout(gpus // per_sample, cfg, ulysses, ring))
    return sorted(found, key=lambda layout: (layout.per_sample, layout.cfg, layout.ring))


def ulysses_bytes_per_rank(sequence: int, heads: int, head_dim: int, ulysses: int, bytes_per_element: int) -> float:
    """Bytes one rank sends in one attention layer: 4 all-to-alls (Q, K, V, output) of a tensor of
    S·H·D elements held as S/u tokens per rank, of which (u-1)/u leave: 4·S·H·D·b·(u-1)/u²."""
    return 4.0 * sequence * heads * head_dim * bytes_per_element * (ulysses - 1) / ulysses**2


def ring_bytes_per_pass(sequence: int, heads: int, head_dim: int, ulysses: int, ring: int, bytes_per_element: int):
    """Bytes one rank sends in one ring pass: its K and V block, (S/r) tokens of H/u heads."""
    return 2.0 * (sequence / ring) * (heads / ulysses) * head_dim * bytes_per_element


@dataclass(frozen=True)
class StepCost:
    """One denoising step of one sample under `layout`, in seconds, per GPU of the sample's group."""

    layout: Layout
    compute_s: float
    ulysses_s: float
    ring_exposed_s: float
    cfg_s: float
    sent_bytes: float  # per rank per step, Ulysses and ring together
    memory_bytes: float  # per GPU: weights and activations

    @property
    def step_s(self) -> float:
        return self.compute_s + self.ulysses_s + self.ring_exposed_s + self.cfg_s

    @property
    def samples_per_s(self) -> float:
        """Sample-steps per second over all of the layout's GPUs (divide by steps for samples/s)."""
        return self.layout.data / self.step_s


def step_cost(model: ModelCost, layout: Layout, hardware: Hardware, ring_overlap: bool = False) -> StepCost:
    """The cost of one step (see the module's docstring for each term)."""
    passes = model.passes // layout.cfg  # forwards each GPU group runs per step
    split = layout.sequence_split
    heads, dim, b, layers = model.heads, model.head_dim, model.bytes_per_element, model.attention_layers
    compute = passes * model.flops_per_forward / split / hardware.flops_per_s
    link, latency = hardware.link_bytes_per_s, hardware.collective_latency_s

    ulysses_s, sent = 0.0, 0.0
    if layout.ulysses > 1:
        per_layer = ulysses_bytes_per_rank(model.sequence / layout.ring, heads, dim, layout.ulysses, b)
        sent += passes * layers * per_layer
        ulysses_s = passes * layers * (per_layer / link + 4 * latency)

    ring_s = 0.0
    if layout.ring > 1:
        block = ring_bytes_per_pass(model.sequence, heads, dim, layout.ulysses, layout.ring, b)
        block_attention = 4.0 * (model.sequence / layout.ring) ** 2 * (heads / layout.ulysses) * dim
        sent += passes * layers * (layout.ring - 1) * block
        if ring_overlap:
            exposed = max(0.0, block / link + latency - block_attention / hardware.flops_per_s)
            ring_s = passes * layers * (layout.ring - 1) * exposed
        else:  # one all-gather of the other r-1 blocks, waited for before the first block's attention
            ring_s = passes * layers * ((layout.ring - 1) * block / link + latency)

    cfg_s = model.velocity_elements / split * b / link + latency if layout.cfg > 1 else 0.0
    activations = passes * model.sequence / split * model.activation_bytes_per_token
    return StepCost(layout, compute, ulysses_s, ring_s, cfg_s, sent, model.weight_bytes + activations)


def pick(costs: list[StepCost], memory_bytes: float, tie: float) -> StepCost | None:
    """The layout for rollouts: the highest throughput among those that fit in `memory_bytes`; of the
    layouts within `tie` (a fraction) of it, the one with the lowest latency per sample (a rollout
    step waits for its slowest sample). None when nothing fits."""
    fitting = [cost for cost in costs if cost.memory_bytes <= memory_bytes]
    if not fitting:
        return None
    best = max(cost.samples_per_s for cost in fitting)
    near = [cost for cost in fitting if cost.samples_per_s >= (1 - tie) * best]
    return min(near, key=lambda cost: (cost.step_s, cost.layout.per_sample))
