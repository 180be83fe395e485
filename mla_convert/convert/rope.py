"""RoPE: which source frequencies survive in DeepSeek's single shared RoPE key, and how.

The source rotates every (head, frequency) pair of its keys.  DeepSeek MLA has one RoPE key of
`rope_dim` dimensions (`rope_dim / 2` rotation slots) shared by all heads, on a geometric frequency
grid `factor^-1 * theta'^(-2l / rope_dim)`.  Three choices decide how much positional signal survives:

1. The grid: slot l sits at fractional source-frequency index `p_l = offset + step * l`.  Such a grid is
   exactly a DeepSeek grid (theta' = theta^(step * rope_dim / head_dim), linear factor
   theta^(2 * offset / head_dim)); `deepseek_rope_parameters` builds it and `target.verify_rope` checks
   the exported config reproduces the intended inverse frequencies numerically.
2. Membership: a source component (kv head g, frequency j) joins the slot nearest to it when rotating
   it at the slot's frequency hurts less than leaving it unrotated (it then goes to the NoPE part).
   Several members per slot generalise RoRoPE (all kv heads at one frequency) and FreqFold (adjacent
   frequencies sharing a slot).
3. The combination: a slot can carry only one complex direction across its members; the best one is
   the top principal direction of the members' keys, weighted by how much each member's rotation
   matters to the queries (`SlotPlan`).  Rotation by a common angle commutes with complex-linear mixing,
   so the kept direction is rotated exactly; the residual directions lose position and join NoPE.

All choices are driven by calibration statistics (`RopeStats`): per-(head, frequency) query and key
energies and each head's attention-distance profile, which turns a frequency error into an expected
logit error.  See `estimate_layer_error`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidShapeError
from .factorize import canonical_signs


@dataclass(frozen=True)
class RopeGrid:
    """Slot l of the shared RoPE key sits at fractional source-frequency index `offset + step * l`."""

    offset: float
    step: float
    num_slots: int

    def positions(self) -> torch.Tensor:
        return self.offset + self.step * torch.arange(self.num_slots, dtype=torch.float64)

    def describe(self) -> str:
        return f"offset {self.offset:g}, step {self.step:g}, {self.num_slots} slots"


def grid_inv_freq(grid: RopeGrid, source_inv_freq: torch.Tensor) -> torch.Tensor:
    """The inverse frequency each slot should rotate at, interpolated geometrically between source freqs.

    The source grid is geometric (possibly reshaped by llama3 scaling, in which case only integer
    positions are used), so log-linear interpolation gives exactly the DeepSeek grid value.
    """
    log_freq = source_inv_freq.detach().double().cpu().log()  # planning runs on the CPU (small tensors)
    positions = grid.positions()
    low = positions.floor().long().clamp(0, len(log_freq) - 1)
    high = (low + 1).clamp(max=len(log_freq) - 1)
    frac = positions - low.double()
    # beyond the last source frequency, extrapolate with the last spacing
    spacing = log_freq[-1] - log_freq[-2] if len(log_freq) > 1 else torch.tensor(0.0, dtype=torch.float64)
    inside = log_freq[low] + frac * (log_freq[high] - log_freq[low])
    beyond = log_freq[-1] + (positions - (len(log_freq) - 1)) * spacing
    return torch.where(positions > len(log_freq) - 1, beyond, inside).exp()


def grid_frame(source_params: dict, head_dim: int, source_inv_freq: torch.Tensor,
               llama3_scaling: bool = True) -> tuple[torch.Tensor, dict]:
    """(frame, its RoPE parameters): the geometric grid a `RopeGrid`'s positions count in.

    Normally the source's own frequencies.  For a llama3 source and a target whose engine ignores llama3 scaling
    (`Target.llama3_scaling`: llama.cpp ignores it, vLLM misreads it), the unscaled grid theta^(-2j/h), a default RoPE: the scaled (slow) frequencies sit on
    it at fractional positions (`frame_positions`), so slots go where the source really rotates, the planner weighs
    what each slot misses, and the export declares default RoPE, which such an engine computes as transformers does.
    """
    if source_params.get("rope_type") == "llama3" and not llama3_scaling:
        from ..source.model import rope_inv_freq

        plain = {"rope_type": "default", "rope_theta": float(source_params["rope_theta"])}
        return rope_inv_freq(plain, head_dim), plain
    return source_inv_freq, source_params


def declaration_note(source_params: dict, export_params: dict) -> str | None:
    """What the export's config does not say about the source's RoPE (None: it declares the source's type)."""
    source_type, export_type = source_params.get("rope_type", "default"), export_params.get("rope_type", "default")
    if source_type != "llama3" or export_type == "llama3":
        return None
    return ("the source's llama3 frequency scaling is not declared: the target's engines would not compute it as "
            "declared (llama.cpp ignores it, vLLM runs it as YaRN), so the shared RoPE key rotates at default-RoPE "
            "frequencies placed where the source's scaled ones fall (what that costs is in the attention error; "
            "docs/engines.md)")


def frame_positions(source_inv_freq: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
    """Each source frequency's (fractional) index on the geometric `frame`: j itself on the source's own grid."""
    omega, frame = source_inv_freq.detach().double().cpu(), frame.detach().double().cpu()
    if torch.equal(omega, frame) or len(frame) < 2:
        return torch.arange(len(omega), dtype=torch.float64)
    positions = (frame[0].log() - omega.log()) / (frame[0].log() - frame[1].log())  # (h/2,)
    # an unscaled frequency is its own index: float32 frequencies put the last one up to ~2e-5 below h/2 - 1, where
    # no grid of h/2 slots fits (convert crashed with rope_dim = head_dim)
    whole = positions.round()
    return torch.where((positions - whole).abs() < 1e-4, whole, positions)


def deepseek_rope_parameters(source_params: dict, grid: RopeGrid, head_dim: int) -> dict:
    """`rope_parameters` for the DeepseekV3 config whose inverse frequencies equal the grid's.

    With a source grid theta^(-2j/h), slot l at index offset + step*l has frequency
    theta^(-2 offset/h) * (theta^(step * D / h))^(-2l/D): a DeepSeek grid with theta' = theta^(step*D/h)
    and linear factor theta^(2 offset/h).
    """
    theta = float(source_params["rope_theta"])
    rope_dim = 2 * grid.num_slots
    rope_type = source_params.get("rope_type", "default")
    new_theta = theta ** (grid.step * rope_dim / head_dim)
    offset_factor = theta ** (2.0 * grid.offset / head_dim)
    if rope_type == "llama3":
        if grid.offset != 0 or grid.step != int(grid.step):
            raise InvalidShapeError("llama3 RoPE scaling only admits grids of whole source frequencies starting at 0")
        params = dict(source_params)
        params["rope_theta"] = new_theta
        return params
    factor = offset_factor * float(source_params.get("factor", 1.0)) if rope_type == "linear" else offset_factor
    if abs(factor - 1.0) < 1e-12:
        return {"rope_type": "default", "rope_theta": new_theta}
    return {"rope_type": "linear", "rope_theta": new_theta, "factor": factor}


def candidate_grids(num_freqs: int, num_slots: int, llama3: bool = False, offsets: bool = True) -> list[RopeGrid]:
    """Every grid of `num_slots` slots inside the source's frequency range.

    Offsets and steps go in half-index units (a half step puts a slot between two source frequencies,
    which FreqFold-style sharing needs).  llama3-scaled sources only admit whole steps from offset 0,
    because their scaled frequencies are not geometric.  `offsets=False`: grids from offset 0 only (a
    default-RoPE source then exports default RoPE, with no linear factor: `Target.rope_offsets`).
    """
    unit = 1.0 if llama3 else 0.5
    if num_slots == 1:
        return [RopeGrid(k * unit, 1.0, 1) for k in range(int((num_freqs - 1) / unit) + 1 if offsets else 1)]
    grids = []
    step = 1.0
    while (num_slots - 1) * step <= num_freqs - 1 + 1e-9:
        max_offset = num_freqs - 1 - (num_slots - 1) * step
        starts = [0.0] if llama3 or not offsets else [k * unit for k in range(int(max_offset / unit + 1e-9) + 1)]
        grids.extend(RopeGrid(offset, step, num_slots) for offset in starts)
        step += unit
    return grids


# --------------------------------------------------------------------------- statistics
@dataclass
class RopeStats:
    """Per-layer calibration statistics that drive the RoPE choices.

    key_cov: (G*h/2, G*h/2) complex second moment of the pre-rotation keys, components ordered
        (kv head, frequency); component (g, j) = k[g, j] + i k[g, j + h/2] in rotate_half layout.
    query_energy: (H, h/2) E|q_ij|^2 of the pre-rotation queries (softmax scale included).
    distance_profile: (H, L) average attention probability at distance t - s, per head.
    """

    key_cov: torch.Tensor
    query_energy: torch.Tensor
    distance_profile: torch.Tensor

    def phi(self, delta: torch.Tensor) -> torch.Tensor:
        """(H, ...) expected 1 - cos(delta * distance) under each head's attention-distance profile."""
        distances = torch.arange(self.distance_profile.shape[1], dtype=torch.float64)
        angles = delta.double().unsqueeze(-1) * distances  # (..., L)
        cost = 1.0 - torch.cos(angles)
        return torch.einsum("hl,...l->h...", self.distance_profile.double(), cost)


def complex_components(rows: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """(num_heads * head_dim, n) real rows in rotate_half layout -> (num_heads, head_dim/2, n) complex."""
    rows = rows.reshape(num_heads, 2, head_dim // 2, -1)  # (heads, re|im, freq, n)
    return torch.complex(rows[:, 0].double(), rows[:, 1].double())


def real_rows(components: torch.Tensor) -> torch.Tensor:
    """Inverse of `complex_components`: (heads, h/2, n) complex -> (heads * h, n) real rotate_half rows."""
    heads, half, n = components.shape
    stacked = torch.stack([components.real, components.imag], dim=1)  # (heads, re|im, h/2, n)
    return stacked.reshape(heads * 2 * half, n)


# --------------------------------------------------------------------------- slot plans
@dataclass
class SlotPlan:
    """One layer's RoPE assignment: for slot l, its members and the complex vectors that mix them.

    members[l]: flat component indices g * (h/2) + j in the slot.
    read[l]: (len(members),) complex; the slot key is c_l = sum_m conj(read_m) z_m.
    write[l]: (len(members),) complex; member m is reconstructed as write_m * c_l, the rest stays NoPE.
    """

    grid: RopeGrid
    slot_inv_freq: torch.Tensor
    members: list[list[int]] = field(default_factory=list)
    read: list[torch.Tensor] = field(default_factory=list)
    write: list[torch.Tensor] = field(default_factory=list)
    estimated_error: float = 0.0
    nope_error: float = 0.0
    # (H, h/2): E[cos(omega_j * distance)] under head i's attention-distance profile, the least-squares
    # factor for a rotated contribution that the export can only give unrotated (NoPE)
    nope_scale: torch.Tensor | None = None


def plan_layer(
    stats: RopeStats,
    grid: RopeGrid,
    source_inv_freq: torch.Tensor,
    num_kv_heads: int,
    max_fold: float = 1.0,
    frame: torch.Tensor | None = None,
    rotates: bool = True,
) -> SlotPlan:
    """Assign components to slots and choose each slot's mixing direction for one layer.

    A component joins its nearest slot (within `max_fold` index units of the grid's `frame`, by default the source's
    own frequencies) when rotating it at the slot's frequency costs less expected logit error than leaving it
    unrotated.  Each slot then keeps the top principal direction of its members' keys, weighted by that saving.
    A layer that does not rotate (`rotates` False: a NoPE layer) keeps every slot empty: its whole key stays NoPE,
    which is what it was, at no error, and its RoPE rows are zero.
    """
    num_heads, half = stats.query_energy.shape
    group = num_heads // num_kv_heads
    omega = source_inv_freq.detach().double().cpu()
    frame = source_inv_freq if frame is None else frame
    slot_freq = grid_inv_freq(grid, frame)
    if not rotates:
        empty = torch.zeros(0, dtype=torch.complex128)
        return SlotPlan(grid=grid, slot_inv_freq=slot_freq.float(), members=[[] for _ in range(grid.num_slots)],
                        read=[empty] * grid.num_slots, write=[empty] * grid.num_slots,
                        nope_scale=torch.ones(num_heads, half))
    positions = grid.positions()
    # nearest slot for each source frequency, in index units of the frame
    distance = (frame_positions(source_inv_freq, frame)[:, None] - positions[None, :]).abs()  # (h/2, slots)
    nearest = distance.argmin(dim=1)
    near_enough = distance.min(dim=1).values <= max_fold + 1e-9
    phi_nope = stats.phi(omega)  # (H, h/2): cost of leaving (i, j) unrotated
    phi_slot = stats.phi(slot_freq[nearest] - omega)  # (H, h/2): cost of rotating (i, j) at its slot's freq
    q_energy = stats.query_energy.double()
    # per kv head: sum over its query heads of query energy x cost
    benefit_heads = q_energy * (phi_nope - phi_slot)  # (H, h/2)
    benefit = benefit_heads.reshape(num_kv_heads, group, half).sum(1)  # (G, h/2)
    plan = SlotPlan(grid=grid, slot_inv_freq=slot_freq.float(), nope_scale=(1.0 - phi_nope).float())
    cov = stats.key_cov
    for slot in range(grid.num_slots):
        freqs = [j for j in range(half) if nearest[j] == slot and near_enough[j]]
        members = [g * half + j for g in range(num_kv_heads) for j in freqs if benefit[g, j] > 0]
        if not members:
            plan.members.append([])
            plan.read.append(torch.zeros(0, dtype=torch.complex128))
            plan.write.append(torch.zeros(0, dtype=torch.complex128))
            continue
        index = torch.tensor(members)
        weight = torch.stack([benefit[m // half, m % half] for m in members]).clamp_min(1e-30)
        sub = cov[index][:, index]  # (m, m) complex key covariance of the members
        root = weight.sqrt().to(sub.dtype)
        weighted = root[:, None] * sub * root[None, :]
        eigvals, eigvecs = torch.linalg.eigh(weighted)
        top = canonical_signs(eigvecs[:, -1])  # the phase of an eigenvector is arbitrary: fix it
        plan.members.append(members)
        plan.read.append(root * top)  # c = top^H (W^1/2 z)
        plan.write.append(top / root)  # z ~ W^-1/2 top c
    plan.estimated_error, plan.nope_error = estimate_layer_error(stats, plan, source_inv_freq, num_kv_heads)
    return plan


def estimate_layer_error(
    stats: RopeStats, plan: SlotPlan, source_inv_freq: torch.Tensor, num_kv_heads: int
) -> tuple[float, float]:
    """Expected squared logit error of a plan, and of dropping RoPE altogether (for reference).

    Each (query head i, frequency j) contributes E|q_ij|^2 x E|part of k_gj|^2 x phi_i(frequency error),
    where the kept part is rotated at the slot frequency and the residual is left unrotated.
    """
    num_heads, half = stats.query_energy.shape
    group = num_heads // num_kv_heads
    omega = source_inv_freq.detach().double().cpu()
    cov = stats.key_cov
    key_energy = cov.diagonal().real.reshape(num_kv_heads, half).clone()  # (G, h/2)
    kept = torch.zeros_like(key_energy)
    kept_freq = torch.zeros(num_kv_heads, half, dtype=torch.float64)
    residual = key_energy.clone()
    for slot, members in enumerate(plan.members):
        if not members:
            continue
        index = torch.tensor(members)
        sub = cov[index][:, index]
        read, write = plan.read[slot], plan.write[slot]
        # projector z -> write * (read^H z); residual (I - P) z
        proj = write[:, None] * read.conj()[None, :]
        eye = torch.eye(len(members), dtype=sub.dtype)
        kept_cov = proj @ sub @ proj.conj().T
        resid_cov = (eye - proj) @ sub @ (eye - proj).conj().T
        for position, member in enumerate(members):
            g, j = divmod(member, half)
            kept[g, j] = kept_cov[position, position].real
            residual[g, j] = resid_cov[position, position].real
            kept_freq[g, j] = plan.slot_inv_freq[slot].double()
    phi_nope = stats.phi(omega)  # (H, h/2)
    q = stats.query_energy.double()
    kv_of_head = torch.arange(num_heads) // group
    error = 0.0
    for head in range(num_heads):
        g = kv_of_head[head]
        phi_kept = stats.phi(kept_freq[g] - omega)[head]
        error += (q[head] * (kept[g] * phi_kept + residual[g] * phi_nope[head])).sum().item()
    nope = sum((q[head] * key_energy[kv_of_head[head]] * phi_nope[head]).sum().item() for head in range(num_heads))
    return error, nope


def augmented_moment(second_moment: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """E[[x;1][x;1]^T] from E[x x^T] and E[x]: lets biases ride along as a constant input."""
    d = second_moment.shape[0]
    out = torch.empty(d + 1, d + 1, dtype=torch.float64, device=second_moment.device)
    out[:d, :d] = second_moment.double()
    out[:d, d] = out[d, :d] = mean.double()
    out[d, d] = 1.0
    return out


def moment_products(rows: torch.Tensor, bias: torch.Tensor | None, second_moment: torch.Tensor,
                    mean: torch.Tensor) -> torch.Tensor:
    """E[(W x + b)(W x + b)^T] = W C W^T + b (W mu)^T + (W mu) b^T + b b^T, float64 (rows, rows).

    The same as [W | b] E[[x;1][x;1]^T] [W | b]^T, without the (d+1) x (d+1) augmented copy of the moment.
    """
    w = rows.double()
    out = (w @ second_moment) @ w.T
    if bias is not None:
        b, projected_mean = bias.double(), w @ mean.double()
        out += b[:, None] * projected_mean[None, :] + projected_mean[:, None] * b[None, :] + b[:, None] * b[None, :]
    return out


def output_energies(rows: torch.Tensor, bias: torch.Tensor | None, second_moment: torch.Tensor, mean: torch.Tensor,
                    block: int = 512) -> torch.Tensor:
    """E[(w_r x + b_r)^2] for every row r: the diagonal of `moment_products`, `block` rows at a time (rows,)."""
    parts = []
    for start in range(0, rows.shape[0], block):
        stop = start + block
        w = rows[start:stop].double()  # (block, d)
        energy = ((w @ second_moment) * w).sum(1)
        if bias is not None:
            b = bias[start:stop].double()
            energy += 2 * b * (w @ mean.double()) + b * b
        parts.append(energy)
    return torch.cat(parts)


def rope_stats_from_moments(
    q_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    second_moment: torch.Tensor,
    mean: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    distance_profile: torch.Tensor,
) -> RopeStats:
    """Query energies and key covariance per (head, frequency), from the input moments and the weights.

    Component (g, j) of a key is z = re + i im with re = row j, im = row j + h/2 of head g (rotate_half layout).
    Real arithmetic on those rows: E[z z'^*] = E[re re'] + E[im im'] + i (E[im re'] - E[re im']) and
    E|z|^2 = E[re^2] + E[im^2], so no complex copy of the d x d moment is made (268 MB at hidden 4096).
    """
    second_moment = second_moment.double()
    half = head_dim // 2

    # key rows ordered [re of every (g, j); im of every (g, j)]: one real product holds all four blocks
    keys = k_weight.reshape(num_kv_heads, 2, half, -1).transpose(0, 1).reshape(2 * num_kv_heads * half, -1)
    key_bias = k_bias.reshape(num_kv_heads, 2, half).transpose(0, 1).reshape(-1) if k_bias is not None else None
    blocks = moment_products(keys, key_bias, second_moment, mean)  # (2n, 2n), n = G*h/2
    n = num_kv_heads * half
    key_cov = torch.complex(blocks[:n, :n] + blocks[n:, n:], blocks[n:, :n] - blocks[:n, n:])  # (G*h/2, G*h/2)
    energies = output_energies(q_weight, q_bias, second_moment, mean).view(num_heads, 2, half)  # (H, re|im, h/2)
    q_energy = energies.sum(1) / head_dim  # (H, h/2)
    return RopeStats(key_cov=key_cov, query_energy=q_energy, distance_profile=distance_profile.double())
