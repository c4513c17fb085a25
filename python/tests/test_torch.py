"""pshard.torch: ModelSync and Embedding against PyTorch's own optimisers."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import pshard  # noqa: E402
import pshard.torch as pt  # noqa: E402


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def batches(n=6, b=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 6, generator=g), torch.randint(0, 3, (b,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("opt,torch_opt", [("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
                                           ("adam", lambda p: torch.optim.Adam(p, lr=0.01))])
def test_model_sync_matches_torch_optimizer(opt, torch_opt):
    with pshard.embedded(servers=2) as ps:
        model = small_model()
        sync = pt.ModelSync(ps, model, opt=opt, lr=0.1 if opt == "sgd" else 0.01)
        ref = small_model()
        ref.load_state_dict(model.state_dict())           # start from the servers' values
        ropt = torch_opt(ref.parameters())
        for x, y in batches():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            assert len(sync._pushes) == 4, "every gradient is pushed from its hook during backward"
            sync.step()
            ropt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ropt.step()
        sync.wait()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=2e-5, atol=2e-6, err_msg=n)
        st = sync.stats()
        assert st["steps"] == 6 and st["wait_pull_s"] >= 0
        sync.close()


def test_default_init_follows_pytorch():
    with pshard.embedded(servers=1) as ps:
        model = torch.nn.Sequential(torch.nn.Linear(400, 30), torch.nn.LayerNorm(30), torch.nn.Linear(30, 2))
        pt.ModelSync(ps, model)
        w, b = model[0].weight.detach().numpy(), model[0].bias.detach().numpy()
        bound = 1 / np.sqrt(400)
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound
        assert np.abs(b).max() <= bound and b.std() > 0
        assert np.all(model[1].weight.detach().numpy() == 1) and np.all(model[1].bias.detach().numpy() == 0)


def test_pulls_land_in_the_parameters_without_copies():
    with pshard.embedded(servers=1) as ps:
        model = small_model()
        before = [p.data.data_ptr() for p in model.parameters()]
        sync = pt.ModelSync(ps, model, init="const:0.5")
        assert [p.data.data_ptr() for p in model.parameters()] == before
        assert all(np.all(p.detach().numpy() == 0.5) for p in model.parameters())
        sync.close()


def test_large_parameters_move_to_shared_memory_once_and_train_the_same():
    """Parameters of 64 KiB and more are moved into pshard.zeros memory at construction
    (the servers of the host then write pulls in place); the storage then stays put and
    training matches PyTorch's SGD."""
    with pshard.embedded(servers=2) as ps:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 4000), torch.nn.ReLU(), torch.nn.Linear(4000, 5))
        sync = pt.ModelSync(ps, model, opt="sgd", lr=0.1)
        ptrs = [p.data.data_ptr() for p in model.parameters()]
        big = [p.numel() * 4 >= 64 << 10 for p in model.parameters()]
        assert big == [True, False, True, False]
        assert all(ptr % 4096 == 0 for ptr, b in zip(ptrs, big) if b)
        ref = torch.nn.Sequential(torch.nn.Linear(6, 4000), torch.nn.ReLU(), torch.nn.Linear(4000, 5))
        ref.load_state_dict(model.state_dict())
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for x, y in batches(4):
            F.cross_entropy(model(x), y).backward()
            sync.step()
            ropt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            ropt.step()
        sync.wait()
        assert [p.data.data_ptr() for p in model.parameters()] == ptrs
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=2e-5, atol=2e-6, err_msg=n)
        sync.close()


def test_unused_parameter_and_accumulation():
    """A parameter without a gradient pushes zeros; two backward passes add up."""
    with pshard.embedded(servers=1) as ps:
        a = torch.nn.Linear(2, 1, bias=False)
        unused = torch.nn.Linear(2, 1, bias=False)
        model = torch.nn.ModuleDict({"a": a, "unused": unused})
        sync = pt.ModelSync(ps, model, opt="sgd", lr=1.0, init="zero")
        x = torch.ones(4, 2)
        for _ in range(2):
            a(x).sum().backward()                 # d/dw sum(w.x) over 4 rows = 4 per weight
        sync.batch = 4
        sync.step()
        sync.wait()
        np.testing.assert_allclose(a.weight.detach().numpy(), [[-8, -8]])
        np.testing.assert_allclose(unused.weight.detach().numpy(), [[0, 0]])


def test_embedding_pulls_and_pushes_only_used_rows():
    with pshard.embedded(servers=2) as ps:
        emb = pt.Embedding(ps, "e", 4, opt="sgd", lr=0.5, init="normal:0.1", seed=2)
        ref = torch.nn.Embedding(100, 4)
        with torch.no_grad():
            ref.weight.copy_(torch.from_numpy(emb.table.pull(np.arange(100))))
        ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
        sync = pt.ModelSync(ps, emb)                 # no dense parameters: waits and clocks
        pulled, pushed = [], []
        orig_pull, orig_push = emb.table.pull, emb.table.push_async
        emb.table.pull = lambda keys, **kw: (pulled.append(np.array(keys)), orig_pull(keys, **kw))[1]
        emb.table.push_async = lambda keys, g, **kw: (pushed.append(np.array(keys)), orig_push(keys, g, **kw))[1]
        g = torch.Generator().manual_seed(3)
        for _ in range(5):
            ids = torch.randint(0, 100, (6, 3), generator=g)
            target = torch.randn(6, 3, 4, generator=g)
            out = emb(ids)
            assert out.shape == (6, 3, 4)
            ((out - target) ** 2).mean().backward()
            sync.step()
            ropt.zero_grad()
            ((ref(ids) - target) ** 2).mean().backward()
            ropt.step()
            assert set(pulled[-1].tolist()) == set(ids.flatten().tolist()) and len(pulled[-1]) == len(set(ids.flatten().tolist()))
            assert set(pushed[-1].tolist()) == set(pulled[-1].tolist())
        np.testing.assert_allclose(emb.table.pull(np.arange(100)), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
        emb.eval()
        with torch.no_grad():
            emb(torch.tensor([1, 2]))
        n = len(pushed)
        sync.step()                                   # eval forward: nothing to push
        assert len(pushed) == n


def test_gpu_or_double_parameters_are_refused():
    with pshard.embedded(servers=1) as ps:
        with pytest.raises(pshard.InvalidArgumentError):
            pt.ModelSync(ps, torch.nn.Linear(2, 2).double())


# ------------------------------------------------------------------------- overlap

def mlp(seed=0):
    torch.manual_seed(seed)
    # 6 -> 3000 -> 5: the first weight and the last (72 KB, 60 KB) include one that lives in
    # shared memory, pulled in place.
    return torch.nn.Sequential(torch.nn.Linear(6, 3000), torch.nn.ReLU(), torch.nn.Linear(3000, 5))


def train_dense(overlap, wait_at="auto", steps=5, opt="adam"):
    with pshard.embedded(servers=2, mode="sync") as ps:
        model = mlp()
        sync = pt.ModelSync(ps, model, opt=opt, lr=0.01, overlap=overlap, wait_at=wait_at)
        losses = []
        for x, y in batches(steps):
            loss = F.cross_entropy(model(x), y) + 1e-3 * sum((p * p).sum() for p in model.parameters())
            loss.backward()
            if overlap:
                assert len(sync._pushes) == 4, "every gradient is pushed from its hook during backward"
            else:
                assert not sync._pushes and all(p.grad is not None for p in model.parameters())
            sync.step()
            losses.append(loss.item())
        sync.wait()
        out = [p.detach().numpy().copy() for p in model.parameters()]
        sync.close()
        return out, losses


@pytest.mark.parametrize("wait_at", ["auto", "module", "forward"])
def test_overlap_is_bit_for_bit_the_blocking_path_in_sync_mode(wait_at):
    """Pushes from hooks, background pulls and per-module waits change when values
    move, not which: the parameters and the losses (which read every parameter) are
    bit for bit those of overlap=False."""
    ref, ref_losses = train_dense(False)
    got, losses = train_dense(True, wait_at)
    assert losses == ref_losses
    for a, b in zip(got, ref):
        assert a.shape == b.shape and np.array_equal(a, b)
    first, _ = train_dense(False, steps=1)
    assert not np.array_equal(first[0], ref[0]), "the training moved the parameters"


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.unused = mlp(), torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.net(x)


def train_blocking(by_hand, steps=5):
    """overlap=False, stepped by ModelSync or by hand: one blocking push per parameter
    (zeros for the unused one), a clock, one blocking pull per parameter."""
    with pshard.embedded(servers=2, mode="sync") as ps:
        model = WithUnused()
        sync = pt.ModelSync(ps, model, opt="adam", lr=0.01, overlap=False)
        first = model.net[0].weight.detach().numpy().copy()
        for x, y in batches(steps):
            pushes = ps.stat("pushes")
            F.cross_entropy(model(x), y).backward()
            if by_hand:
                for t, p in zip(sync.tables, sync._params):
                    t.push(np.zeros(t.shape, np.float32) if p.grad is None else p.grad.numpy(), batch=len(x))
                    p.grad = None
                ps.clock()
                for t, p in zip(sync.tables, sync._params):
                    t.pull(out=p.data.numpy().reshape(-1))
            else:
                sync.step()
            assert ps.stat("pushes") - pushes == len(sync.tables)
        out = [p.detach().numpy().copy() for p in model.parameters()]
        sync.close()
        return first, out


def test_blocking_step_is_one_call_after_another_bit_for_bit():
    """overlap=False starts a phase's requests together (every push, then every pull):
    the parameters are bit for bit those of one blocking call after another, and a step
    pushes once per parameter."""
    first, got = train_blocking(False)
    _, ref = train_blocking(True)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and np.array_equal(a, b)
    assert not np.array_equal(got[0], first), "the training moved the parameters"


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("model_fn,wait_at,pending_at_first", [
    (lambda: torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)), "auto", [2, 3]),
    (lambda: torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)), "forward", []),
    (Net, "auto", []),          # a custom forward may read any parameter below it: waits for all
    (Net, "module", [2, 3]),
])
def test_next_forward_waits_for_each_pull_just_before_its_module(model_fn, wait_at, pending_at_first):
    with pshard.embedded(servers=1, mode="sync") as ps:
        torch.manual_seed(0)
        model = model_fn()
        sync = pt.ModelSync(ps, model, opt="sgd", lr=0.1, wait_at=wait_at)
        first = list(model.children())[0]
        seen = []
        first.register_forward_pre_hook(lambda m, a: seen.append(sync.pending_pulls()))
        x = torch.randn(8, 4)
        model(x).sum().backward()
        sync.step()
        assert sync.pending_pulls() == [0, 1, 2, 3], "step() starts every pull and returns"
        out = model(x)
        assert seen[-1] == pending_at_first
        assert sync.pending_pulls() == [], "every pull is waited once the forward returns"
        out.sum().backward()
        sync.step()
        sync.close()


def test_wait_at_is_checked():
    with pshard.embedded(servers=1) as ps:
        with pytest.raises(pshard.InvalidArgumentError):
            pt.ModelSync(ps, small_model(), wait_at="later")


def train_embedding(prefetch, steps=6, early=False):
    """MF-like model: an Embedding and a dense layer, consecutive batches sharing ids
    (so a prefetch that did not see the last round would read stale rows)."""
    with pshard.embedded(servers=2, mode="sync") as ps:
        torch.manual_seed(0)
        emb = pt.Embedding(ps, "e", 4, opt="adagrad", lr=0.5, init="normal:0.1", seed=2)
        model = torch.nn.Sequential(emb, torch.nn.Linear(4, 1))
        sync = pt.ModelSync(ps, model, opt="sgd", lr=0.1)
        g = torch.Generator().manual_seed(3)
        ids = [torch.randint(0, 20, (16,), generator=g) for _ in range(steps)]
        targets = [torch.randn(16, 1, generator=g) for _ in range(steps)]
        for t in range(steps):
            if prefetch and early and t + 1 < steps:
                emb.prefetch(ids[t + 1])      # before this step's forward: too early to be of use
            loss = ((model(ids[t]) - targets[t]) ** 2).mean()
            if prefetch and not early and t + 1 < steps:
                emb.prefetch(ids[t + 1])      # deferred until step() has clocked
                assert emb._prefetch.future is None
            loss.backward()
            sync.step()
        sync.wait()  # the last step's pulls into the model run in the background
        rows = emb.table.pull(np.arange(20))
        w = model[1].weight.detach().numpy().copy()
        st = sync.stats()
        sync.close()
        return rows, w, st


def test_embedding_prefetch_gives_the_same_model_in_sync_mode():
    ref_rows, ref_w, st0 = train_embedding(False)
    rows, w, st = train_embedding(True)
    assert np.array_equal(rows, ref_rows) and np.array_equal(w, ref_w)
    assert st0["prefetch_hits"] == 0
    assert st["prefetch_hits"] == 5 and st["prefetch_misses"] == 0
    # A prefetch started before the step's clock would miss the round: it is dropped.
    rows, w, st = train_embedding(True, early=True)
    assert np.array_equal(rows, ref_rows) and np.array_equal(w, ref_w)
    assert st["prefetch_hits"] == 0 and st["prefetch_misses"] == 5


def test_embedding_prefetch_without_model_sync_and_other_ids_in_between():
    with pshard.embedded(servers=1, mode="sync") as ps:
        emb = pt.Embedding(ps, "e", 2, opt="sgd", lr=1.0, init="const:1")
        ids = torch.tensor([3, 5, 3])
        emb(ids).sum().backward()             # gradient 2 for row 3, 1 for row 5: rows -1 and 0
        emb.prefetch(ids)                     # a training step is open: deferred
        emb.wait()
        ps.clock()
        emb.start_prefetch()
        with torch.no_grad():
            emb.eval()
            np.testing.assert_array_equal(emb(torch.tensor([5])).numpy(), [[0, 0]])
            emb.train()
        assert emb.prefetch_hits == 0 and emb._prefetch is not None, "other ids leave the prefetch"
        out = emb(ids)
        assert emb.prefetch_hits == 1
        np.testing.assert_array_equal(out.detach().numpy(), [[-1, -1], [0, 0], [-1, -1]])
