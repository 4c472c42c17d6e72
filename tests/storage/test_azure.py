"""The az:// store against Azurite on loopback: the contract suites, a save and load by URL (blocks staged in parallel,
ranges read in parallel), a run with retention and incremental saves, the commit race decided by the service's
If-None-Match: *, staged blocks of a killed save found and removed by cleanup."""

from __future__ import annotations

import sys
import uuid

import pytest
import torch

import distckpt
from distckpt import CheckpointError, CorruptCheckpointError, MissingDependencyError
from distckpt.backends import azure
from distckpt.backends.azure import AzureStore, parse_az_url
from distckpt.backends.leases import Lease, simulate_process_death
from distckpt.faults import Fault, inject
from distckpt.testing import run_ranks
from distckpt.testing.blob_store_suite import BlobStoreSuite
from distckpt.testing.states import blank_like, seeded
from distckpt.testing.storage_suite import StorageSuite

from ..distributed import workers


def names(service, container, prefix, uncommitted=False):
    listed = service.get_container_client(container).list_blobs(
        name_starts_with=prefix + "/", include=["uncommittedblobs"] if uncommitted else None)
    return sorted(b.name[len(prefix) + 1:] for b in listed)


class TestAzureStorage(StorageSuite):
    @pytest.fixture(autouse=True)
    def _container(self, azure_container):
        self.container = azure_container

    def checkpoint_id(self, tmp_path, name):
        return f"az://{self.container}/{tmp_path.name}/{name}"


class TestAzureBlobStore(BlobStoreSuite):
    @pytest.fixture(autouse=True)
    def _container(self, azure_container):
        self.container = azure_container

    def make_store(self, tmp_path, name):
        return AzureStore(self.container, f"contract/{tmp_path.name}/{name}")


def _state(n=3 << 20):
    return seeded({"big": torch.arange(n, dtype=torch.float32), "small": torch.arange(10)}, seed=3, values={"step": 7})


def test_the_spellings_of_an_azure_url():
    assert parse_az_url("az://ct/run/step-1") == ("ct", None, "run/step-1", "az")
    assert parse_az_url("abfs://ct@acct.dfs.core.windows.net/run/") == ("ct", "acct.dfs.core.windows.net", "run", "abfs")
    with pytest.raises(CheckpointError, match="needs a container and a prefix"):
        parse_az_url("az://ct")


def test_save_and_load_by_url_with_blocks_and_parallel_reads(azure_service, azure_container, monkeypatch):
    """A 12 MiB tensor goes up as 5 MiB blocks staged in parallel and comes back in parallel 1 MiB ranges, by both
    spellings of the URL."""
    monkeypatch.setenv("DISTCKPT_S3_READ_PIECE_BYTES", str(1 << 20))
    monkeypatch.setenv("DISTCKPT_S3_PART_BYTES", str(5 << 20))
    blocks, ranges = [], []
    send, read_range = azure.AzureBlobWriter._send, azure.AzureBlobReader._read_range
    monkeypatch.setattr(azure.AzureBlobWriter, "_send", lambda self, part: (blocks.append(len(part)), send(self, part)))
    monkeypatch.setattr(azure.AzureBlobReader, "_read_range", lambda self, v, o: (ranges.append(sum(map(len, v))),
                                                                              read_range(self, v, o)))
    cid = f"az://{azure_container}/url/step-1"
    sd = _state()
    md = distckpt.save(sd, checkpoint_id=cid)
    save_id = md.storage_meta.save_id
    assert names(azure_service, azure_container, "url/step-1", uncommitted=True) == [
        "metadata.json", f"saves/{save_id}/data-00000.safetensors"]
    props = azure_service.get_blob_client(azure_container, "url/step-1/metadata.json").get_blob_properties()
    assert props.metadata == {"distckpt_save_id": save_id}
    out = blank_like(sd)
    distckpt.load(out, checkpoint_id=f"abfs://{azure_container}/url/step-1")
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["small"], sd["small"]) and out["step"] == 7
    assert distckpt.verify(cid).ok
    assert blocks[:2] == [5 << 20, 5 << 20] and max(ranges) == 1 << 20 and len(ranges) >= 12, (blocks, ranges)


def test_a_run_with_retention_and_incremental_saves(azure_service, azure_container):
    from tests.crash.test_incremental_machine import incremental_state, stray_keys

    root = f"az://{azure_container}/run-{uuid.uuid4().hex[:8]}"
    mgr = distckpt.CheckpointManager(root, keep_last=2, incremental=True)
    for step in (1, 2, 3, 4):
        mgr.save(step, incremental_state(step))
    assert mgr.all_steps() == [3, 4]
    assert any(n.startswith("step-0000000001/") for n in distckpt.read_metadata(mgr.path(4)).storage_data.files)
    prefix = root[len(f"az://{azure_container}/"):]
    assert stray_keys(names(azure_service, azure_container, prefix, uncommitted=True), mgr) == []
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in incremental_state(4).items()}
    assert mgr.load(out) == 4
    assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in incremental_state(4).items())


def test_of_two_racing_saves_exactly_one_commits(azure_service, azure_container):
    """The loser's Put Blob with If-None-Match: * gets 409 from the service: never an overwrite."""
    cid = f"az://{azure_container}/race/ckpt"
    fired = []

    def other_save_commits_first(kind, where):
        if not fired:
            fired.append(where)
            distckpt.save({"w": torch.full((3,), 5.0)}, checkpoint_id=cid)

    with pytest.raises(CheckpointError, match="committed by another save"):
        with inject(Fault("call", kinds=("rename",), callback=other_save_commits_first)):
            distckpt.save({"w": torch.full((3,), 9.0)}, checkpoint_id=cid)
    out = {"w": torch.zeros(3)}
    distckpt.load(out, checkpoint_id=cid)
    assert torch.equal(out["w"], torch.full((3,), 5.0))
    saves = {k.split("/")[1] for k in names(azure_service, azure_container, "race/ckpt") if k.startswith("saves/")}
    assert len(saves) == 1
    assert AzureStore(azure_container, "race/ckpt").incomplete_saves() == []


def test_an_object_replaced_while_open_is_an_error(azure_service, azure_container):
    store = AzureStore(azure_container, "replaced")
    w = store.create("blob")
    w.pwrite(memoryview(b"a" * 100), 0)
    w.close(True)
    blob = store.open("blob")
    assert blob.pread(10, 5) == b"a" * 10
    azure_service.get_blob_client(azure_container, "replaced/blob").upload_blob(b"b" * 100, overwrite=True)
    with pytest.raises(CorruptCheckpointError, match="changed while it was being read"):
        blob.pread(10, 5)


def test_staged_blocks_of_a_dead_save_are_uploads_that_cleanup_removes(azure_service, azure_container):
    """A save killed after staging blocks, before its Put Block List, leaves no blob but billed blocks: the manager's
    start-up cleanup finds them (uploads) and drops those of dead saves only."""
    root_prefix = uuid.uuid4().hex[:8]
    root = f"az://{azure_container}/{root_prefix}"
    distckpt.CheckpointManager(root).save(1, {"w": torch.ones(2)})
    dead_key = f"{root_prefix}/step-0000000002/saves/{'a' * 32}/data-00000.safetensors"
    azure_service.get_blob_client(azure_container, dead_key).stage_block("b-00000000", b"x" * 1024)
    Lease(AzureStore(azure_container, f"{root_prefix}/step-0000000002"), "a" * 32)
    simulate_process_death()
    live_key = f"{root_prefix}/step-0000000003/saves/{'b' * 32}/data-00000.safetensors"
    live = Lease(AzureStore(azure_container, f"{root_prefix}/step-0000000003"), "b" * 32)
    azure_service.get_blob_client(azure_container, live_key).stage_block("b-00000000", b"y" * 1024)
    try:
        assert {u.key for u in AzureStore(azure_container, root_prefix).objects.uploads(root_prefix + "/")} == {dead_key, live_key}
        distckpt.CheckpointManager(root)  # start-up cleanup
        left = {u.key for u in AzureStore(azure_container, root_prefix).objects.uploads(root_prefix + "/")}
        assert left == {live_key}, left
    finally:
        live.release()
    assert distckpt.CheckpointManager(root).all_steps() == [1]


def test_a_missing_container_names_the_fix(azure_endpoint):
    with pytest.raises(distckpt.StorageIOError, match="container does not exist; create it"):
        distckpt.save({"w": torch.ones(2)}, checkpoint_id=f"az://no-such-{uuid.uuid4().hex[:8]}/ck")


def test_without_the_sdk_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "azure.storage.blob", None)
    monkeypatch.setattr(azure, "_CLIENTS", {})
    with pytest.raises(MissingDependencyError, match=r"distckpt\[azure\]") as info:
        distckpt.save({"w": torch.ones(2)}, checkpoint_id="az://container/ck")
    assert "azure-storage-blob" in str(info.value)


def test_an_empty_metadata_blob_is_a_damaged_checkpoint(azure_service, azure_container):
    """A ranged read of an empty blob answers 416: the store reads it as no bytes, and the loader names the damage."""
    azure_service.get_blob_client(azure_container, "empty/ck/metadata.json").upload_blob(b"")
    with pytest.raises(CorruptCheckpointError):
        distckpt.load({"w": torch.zeros(2)}, checkpoint_id=f"az://{azure_container}/empty/ck")
    with pytest.raises(CheckpointError, match="cannot read") as info:
        distckpt.save({"w": torch.ones(2)}, checkpoint_id=f"az://{azure_container}/empty/ck", overwrite=True)
    assert "failed" not in str(info.value), info.value  # the document's damage, not a failed request


@pytest.mark.slow
def test_two_ranks_save_and_one_and_three_load_resharded(azure_container):
    """Ranks are processes of their own: each makes its own client (clients are per process) from the environment."""
    cid = f"az://{azure_container}/ranks-{uuid.uuid4().hex[:8]}/ckpt"
    run_ranks(workers.save_all_layouts, 2, cid, timeout_s=180)
    for world in (1, 3):
        results = run_ranks(workers.load_all_layouts, world, [cid], timeout_s=180)
        assert all(r == {} for r in results), results


class _CountingService:
    """A service client that counts the containers asked of it: proof that the given one is used."""

    def __init__(self, service):
        self.service, self.asked = service, 0

    def get_container_client(self, name):
        self.asked += 1
        return self.service.get_container_client(name)

    def __getattr__(self, name):
        return getattr(self.service, name)


def test_a_manager_on_az_takes_a_service_as_a_storage_option(azure_service, azure_container):
    service = _CountingService(azure_service)
    mgr = distckpt.CheckpointManager(f"az://{azure_container}/{uuid.uuid4().hex}", keep_last=1, storage_options={"service": service})
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    out = {"w": torch.zeros(4)}
    assert mgr.load(out) == 2 and torch.equal(out["w"], torch.full((4,), 2.0))
    assert mgr.all_steps() == [2] and service.asked > 0


@pytest.mark.parametrize("host,endpoint", [
    ("acct.dfs.core.windows.net", "https://acct.blob.core.windows.net/"),
    ("acct.dfs.core.chinacloudapi.cn", "https://acct.blob.core.chinacloudapi.cn/"),
    ("acct.blob.core.usgovcloudapi.net", "https://acct.blob.core.usgovcloudapi.net/"),
])
def test_an_abfs_account_keeps_its_cloud(monkeypatch, host, endpoint):
    """An id naming an account of another cloud reaches that cloud's endpoint (an account of the same name in the
    public cloud is another account); nothing is sent: the client's URL is looked at."""
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "a2V5a2V5a2V5a2V5")
    container, account, prefix, scheme = parse_az_url(f"abfss://ckpts@{host}/run/step-1")
    store = AzureStore(container, prefix, account=account, scheme=scheme)
    assert store.objects.container.url.startswith(endpoint) and host in store.describe()

