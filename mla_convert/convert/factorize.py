"""Low-rank factorization of the stacked NoPE-key / value projection into MLA down/up projections.

MLA caches c = W_down x (rank R) and rebuilds every head's NoPE key and value as W_up c.  Which rank-R
subspace to keep decides quality:

- `weight` (plain SVD of W): treats every input direction and every output row as equally important.
  Known to be very poor; kept for comparison (`--method svd`).
- `input`: whitens the input side with the calibration second moment C = E[x x^T], so the error is
  measured on real activations: minimise E||(W - W_up W_down) x||^2.
- `output` (default, "activation-aware"): additionally weights each output row by what its error
  costs downstream.  A NoPE-key error e moves the logits by q^T e, so key rows are weighted by the
  queries' second moment E[q q^T]; a value error moves the layer output by W_o e, so value rows are
  weighted by W_o^T W_o.  The two blocks are scaled to equal energy (`kv_balance` shifts that), since
  a fixed K/V ratio did not transfer between models.

Given the chosen subspace (W_down), the best W_up is the least-squares fit on the calibration
activations, whatever the output weighting: W_up = W C W_down^T (W_down C W_down^T)^-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("output", "input", "weight")


WHITENING_DAMPING = 1e-2  # fraction of the mean input variance added to every direction (see Whitening.of)
# `leading_right_singular` takes a wide matrix's vectors from its Gram matrix only while every kept singular value is at
# least this fraction of the largest: squaring the spectrum costs float64 about (largest / kept)^2 x 1e-16 of accuracy
# in those vectors (<= 1e-8 here, below the float32 export's rounding); below it, the SVD is used
GRAM_SINGULAR_FLOOR = 1e-4


def psd_root(matrix: torch.Tensor, rel_floor: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric square root and inverse square root of a PSD matrix, flooring tiny eigenvalues."""
    matrix = 0.5 * (matrix + matrix.T)
    eigvals, eigvecs = torch.linalg.eigh(matrix.double())
    floor = eigvals.max().clamp_min(1e-300) * rel_floor
    eigvals = eigvals.clamp_min(floor)
    root = (eigvecs * eigvals.sqrt()) @ eigvecs.T
    inv_root = (eigvecs * eigvals.rsqrt()) @ eigvecs.T
    return root, inv_root


def symmetrize_(matrix: torch.Tensor, block: int = 512) -> torch.Tensor:
    """(M + M^T) / 2 in place, a block of rows at a time (a whole second copy is 134 MB at hidden 4096).

    Block rows [start, stop) are paired with block columns [start, stop) over [0, stop): neither region has been
    written by an earlier block, and each average is written to both triangles, so every entry equals
    (m_ij + m_ji) * 0.5 exactly as the out-of-place form gives it (bitwise symmetric).
    """
    n = matrix.shape[0]
    for start in range(0, n, block):
        stop = min(start + block, n)
        average = (matrix[start:stop, :stop] + matrix[:stop, start:stop].T).mul_(0.5)  # (stop - start, stop)
        matrix[start:stop, :stop] = average
        matrix[:stop, start:stop] = average.T
    return matrix


def canonical_signs(rows: torch.Tensor) -> torch.Tensor:
    """Each row times the sign (real) or phase (complex) that makes its largest-magnitude entry real and positive.

    Singular and eigen vectors are defined up to that factor, and LAPACK picks it differently with other
    thread counts or devices; fixing it makes the output bytes a function of the inputs alone.
    """
    peak = rows.abs().argmax(dim=-1, keepdim=True)  # (..., 1)
    value = rows.gather(-1, peak)
    factor = value / value.abs().clamp_min(torch.finfo(rows.abs().dtype).tiny)
    return rows / factor


def leading_right_singular(target: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every singular value of `target` (rows, n), descending, and its leading `rank` right singular vectors (rank, n).

    Why not always `torch.linalg.svd`: at Llama-3-8B width the weighted K/V target is 2048 x 4096 float64, and gesdd
    holds a copy of it, both singular bases and its workspace (about 0.23 GiB, the converting phase's peak) for the
    512 vectors kept.  For a wide matrix the same vectors follow from the rows x rows Gram matrix: with
    target target^T = U diag(s^2) U^T, the right vectors are diag(1/s) U^T target, one small eigendecomposition and
    one product.  Squaring the spectrum costs accuracy on small singular values, so the SVD is used whenever a kept one
    is below GRAM_SINGULAR_FLOOR of the largest (full rank of an ill-conditioned layer, exactness tests), and for tall
    matrices, where it holds no more than the Gram matrix would.
    """
    rows, n = target.shape
    if rows < n:
        eigvals, eigvecs = torch.linalg.eigh(target @ target.T)  # ascending; (rows,), (rows, rows)
        singular = eigvals.flip(0).clamp_min(0).sqrt()
        if singular[rank - 1] >= GRAM_SINGULAR_FLOOR * singular[0] > 0:
            kept = eigvecs[:, -rank:].flip(1)  # (rows, rank): the leading left vectors, largest first
            del eigvecs
            return singular, (kept.T @ target).div_(singular[:rank, None])  # (rank, n)
        del eigvals, eigvecs
    _, singular, vh = torch.linalg.svd(target, full_matrices=False)
    return singular, vh[:rank].clone()


@dataclass
class Factorization:
    down: torch.Tensor  # (rank, d_in)
    up: torch.Tensor  # (rows, rank)
    kept_energy: float  # fraction of the (weighted) energy inside the kept subspace
    singular_values: torch.Tensor


@dataclass
class Whitening:
    """E[x x^T] (ridge-damped) as its eigendecomposition V diag(lam) V^T, computed once per layer.

    Held as eigenvectors and eigenvalues rather than as the moment, its square root and its inverse square
    root: each d x d float64 matrix is 134 MB at hidden 4096, and `factorize` needs them only as products,
    which cost no more in the eigenbasis.
    """

    eigvecs: torch.Tensor  # (d, d) V, orthonormal columns
    eigvals: torch.Tensor  # (d,) lam: C = V diag(lam) V^T
    root_eigvals: torch.Tensor  # (d,) lam floored at 1e-8 x its largest (see psd_root): C^1/2 = V diag(sqrt) V^T

    @classmethod
    def of(cls, second_moment: torch.Tensor, damping: float | None = None, consume: bool = False) -> Whitening:
        """Ridge-damped whitening: E[x x^T] + damping * mean(diag) * I.

        Why damp: with fewer calibration tokens than input dimensions (or inputs that never vary along
        some direction) the moment is singular, and an undamped whitening sends directions the
        calibration never saw through huge inverse roots: on real text those latents dwarf the
        calibrated ones and fp32 cancellation makes the model chaotic (SmolLM2 on 2 x 64 calibration
        tokens). 1% of the mean variance was measured neutral to slightly better at default calibration
        (SmolLM2 2x 41.56 -> 41.47, stories260K 6.84 -> 6.80). The damping is ridge regression on the
        activations, so the least-squares `up` uses it too.

        `consume`: the caller needs `second_moment` no more, so a float64 one is damped, symmetrised and
        overwritten by the eigenvectors in its own storage. Otherwise one copy is made; either way no other
        d x d buffer than LAPACK's workspace exists (at hidden 4096 each is 134 MB).
        """
        damping = WHITENING_DAMPING if damping is None else damping
        moment = second_moment.to(torch.float64, copy=not consume).contiguous()
        if damping > 0:
            moment.diagonal().add_(damping * moment.diagonal().mean())
        symmetrize_(moment)
        if moment.device.type == "cpu":
            # eigenvectors written over the moment (its transpose: the column-major layout LAPACK returns; the
            # matrix is symmetric, so the same one): no d x d copy for the eigenvectors. Bitwise equal to
            # `eigh(moment)` (checked on the CPU; CUDA keeps the plain call, where host memory is not at stake).
            eigvals = torch.empty(moment.shape[0], dtype=torch.float64)
            eigvals, eigvecs = torch.linalg.eigh(moment.mT, out=(eigvals, moment.mT))
        else:
            eigvals, eigvecs = torch.linalg.eigh(moment)
        del moment
        root_eigvals = eigvals.clamp_min(eigvals.max().clamp_min(1e-300) * 1e-8)
        return cls(eigvecs, eigvals, root_eigvals)

    @property
    def second_moment(self) -> torch.Tensor:
        """The damped moment as a matrix (d, d): for callers that need it whole (tests, small shapes)."""
        return (self.eigvecs * self.eigvals) @ self.eigvecs.T


def weigh_rows_(target: torch.Tensor, row_weight_roots: list[torch.Tensor]) -> torch.Tensor:
    """target <- blockdiag(roots) @ target, in place, one diagonal block at a time.

    The output-side weighting is block diagonal (one h x h block per kv head and role): as a dense (rows, rows)
    matrix it cost a 2048 x 2048 x 4096 product and two (rows, d) buffers per K/V attempt at Llama-3-8B width,
    for 1/16 of the arithmetic.
    """
    start = 0
    for root in row_weight_roots:  # (n, n) each
        stop = start + root.shape[0]
        target[start:stop] = root.to(target) @ target[start:stop]
        start = stop
    if start != target.shape[0]:
        raise ValueError(f"row weighting covers {start} rows of {target.shape[0]}")
    return target


def factorize(
    weight: torch.Tensor,
    rank: int,
    whitening: Whitening | None = None,
    row_weight_roots: list[torch.Tensor] | None = None,
) -> Factorization:
    """W (rows, d_in) ~ up @ down with down (rank, d_in).

    whitening: the inputs' second moment (None: weight-only SVD, every input direction equal).
    row_weight_roots: the diagonal blocks, top to bottom, of the block-diagonal square root of the output-side
    weighting (None: identity).
    """
    weight = weight.double()
    if whitening is None:
        target = weight if row_weight_roots is None else weigh_rows_(weight.clone(), row_weight_roots)
        singular, vh = leading_right_singular(target, rank)
        down = canonical_signs(vh)
        up = weight @ down.T  # rows of down are orthonormal: least squares in the weight metric
        energy = singular.pow(2)
        return Factorization(down, up, (energy[:rank].sum() / energy.sum().clamp_min(1e-300)).item(), singular)
    # in the eigenbasis of C: W C^1/2 = (W V) diag(sqrt lam) V^T, and the trailing rotation V^T changes no singular value,
    # so the SVD runs on (W V) diag(sqrt lam) and its right vectors are rotated back only for the kept rank
    target = (weight @ whitening.eigvecs).mul_(whitening.root_eigvals.sqrt())  # (rows, d_in)
    if row_weight_roots is not None:
        weigh_rows_(target, row_weight_roots)
    singular, vh = leading_right_singular(target, rank)
    del target
    kept = canonical_signs(vh @ whitening.eigvecs.T) @ whitening.eigvecs  # (rank, d_in) in the eigenbasis
    del vh
    down_v = kept / whitening.root_eigvals.sqrt()  # (rank, d_in): C^-1/2 applied; the latent has unit second moment per dimension
    down = down_v @ whitening.eigvecs.T  # (rank, d_in)
    gram = (down_v * whitening.eigvals) @ down_v.T  # (rank, rank): down C down^T
    # least squares on the activations: up = W C down^T gram^-1, with C down^T = V diag(lam) down_v^T (d_in, rank),
    # formed from the thin side so that no (rows, d_in) product of W is held through the SVD above
    moment_down = whitening.eigvecs @ (down_v * whitening.eigvals).T  # (d_in, rank)
    up = torch.linalg.solve(gram, (weight @ moment_down).T).T  # (rows, rank)
    energy = singular.pow(2)
    return Factorization(down, up, (energy[:rank].sum() / energy.sum().clamp_min(1e-300)).item(), singular)
