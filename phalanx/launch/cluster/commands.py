"""The command-line front of the cluster launchers: `phalanx cluster slurm` and `phalanx cluster k8s`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from phalanx.console import ArgsArg, JsonOpt, err, print_table, split_config_args

NodesOpt = typer.Option(1, "--nodes", min=1, help="Nodes, one phalanx node agent on each.")
GpusOpt = typer.Option(1, "--gpus-per-node", min=1, help="GPUs per node: one rank each.")
RequeuesOpt = typer.Option(5, "--max-requeues", min=0, help="How often the scheduler may run the job again.")


def register(app: typer.Typer) -> None:
    cluster_app = typer.Typer(
        no_args_is_help=True,
        help="Run training on a Slurm or Kubernetes cluster.",
        epilog="Example: phalanx cluster slurm my.yaml --nodes 4 --gpus-per-node 8 --out job.sbatch --submit",
    )
    app.add_typer(cluster_app, name="cluster")

    @cluster_app.command(
        "slurm",
        epilog="Examples: phalanx cluster slurm my.yaml --nodes 4 --gpus-per-node 8 "
        "--partition gpu --time 2-00:00:00 --out job.sbatch --submit  |  phalanx cluster slurm "
        "my.yaml --nodes 2 --gpus-per-node 4 --cpu --out job.sbatch",
    )
    def slurm(
        args: Optional[list[str]] = ArgsArg,
        nodes: int = NodesOpt,
        gpus_per_node: int = GpusOpt,
        out: Path = typer.Option(..., "--out", help="The sbatch script to write (its config goes beside it)."),
        partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition."),
        time: Optional[str] = typer.Option(None, "--time", help="Time limit, e.g. 2-00:00:00 or 90."),
        account: Optional[str] = typer.Option(None, "--account", help="Slurm account to charge."),
        cpu: bool = typer.Option(False, "--cpu", help="Ranks on CPUs: ask Slurm for no GPUs."),
        signal_before: int = typer.Option(
            120,
            "--signal-before",
            help="Seconds before the time limit at which the node agents get SIGTERM (and the job requeues).",
        ),
        port: Optional[int] = typer.Option(None, "--port", help="Rendezvous port (default: from the job id)."),
        max_requeues: int = RequeuesOpt,
        submit: bool = typer.Option(False, "--submit", help="Also submit it with sbatch."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Write an sbatch script: `phalanx train` on every node, requeued when the run can go on.

        It requeues on preemption and the time limit (143) and on exits 4, 5 and 7, never on 1, 2, 3
        or 6. The script, its config and the run directory must be on a filesystem every node sees.
        """
        from phalanx.launch.cluster.job_config import check_not_source, load_job_config, resolved_yaml
        from phalanx.launch.cluster.slurm import SlurmJob, config_path_for, render_sbatch
        from phalanx.launch.cluster.slurm import submit as sbatch

        path, overrides = split_config_args(args)
        config = load_job_config(path, overrides, nodes, gpus_per_node)
        job = SlurmJob(
            nodes=nodes,
            ranks_per_node=gpus_per_node,
            job_name=config.run.name,
            partition=partition,
            time=time,
            account=account,
            cpu=cpu,
            signal_before_s=signal_before,
            port=port,
            max_requeues=max_requeues,
        )
        script = out.expanduser().absolute()
        config_file = config_path_for(script)
        check_not_source(config_file, path)
        check_not_source(script, path)
        text = render_sbatch(job, script, config_file)
        script.parent.mkdir(parents=True, exist_ok=True)
        config_file.write_text(resolved_yaml(config, "phalanx cluster slurm"))
        script.write_text(text)
        script.chmod(0o755)
        report = {
            "script": str(script),
            "config": str(config_file),
            "run_dir": str(config.run_dir),
            "nodes": nodes,
            "ranks": nodes * gpus_per_node,
            "job_id": sbatch(script) if submit else None,
        }
        if json_out:
            print(json.dumps(report))
        else:
            print_table("slurm job", report)

    @cluster_app.command(
        "k8s",
        epilog="Example: phalanx cluster k8s my.yaml --nodes 4 --gpus-per-node 8 "
        "--image registry.example/phalanx:0.1 --vendor amd --out k8s/  (then kubectl apply -f k8s/)",
    )
    def k8s(
        args: Optional[list[str]] = ArgsArg,
        nodes: int = NodesOpt,
        gpus_per_node: int = GpusOpt,
        image: str = typer.Option(..., "--image", help="The image with phalanx (build it from the Dockerfile)."),
        vendor: str = typer.Option("amd", "--vendor", help="amd (amd.com/gpu) or nvidia (nvidia.com/gpu)."),
        out: Path = typer.Option(..., "--out", help="Folder for the manifests and the Dockerfile."),
        name: Optional[str] = typer.Option(
            None, "--name", help="Name of the Job and its objects (default: from run.name)."
        ),
        port: int = typer.Option(29500, "--port", help="Rendezvous port."),
        shm_size: Optional[str] = typer.Option(None, "--shm-size", help="Size of /dev/shm (default: 2Gi per GPU)."),
        volume_size: str = typer.Option("100Gi", "--volume-size", help="Size of the shared runs volume."),
        storage_class: Optional[str] = typer.Option(
            None, "--storage-class", help="StorageClass of that volume (it must offer ReadWriteMany)."
        ),
        max_requeues: int = RequeuesOpt,
        json_out: bool = JsonOpt,
    ) -> None:
        """Write Kubernetes manifests and a Dockerfile: `phalanx train` in every pod of an Indexed Job.

        An Indexed Job with a headless Service for the rendezvous, the config in a ConfigMap, a shared
        volume for runs; apply them with `kubectl apply -f OUT`.
        """
        from phalanx.launch.cluster.job_config import dns_label, load_job_config, resolved_yaml
        from phalanx.launch.cluster.k8s import RUNS_MOUNT, check_options, local_paths, manifests, pod_config, write

        path, overrides = split_config_args(args)
        config = pod_config(load_job_config(path, overrides, nodes, gpus_per_node))
        shm_size = shm_size or f"{2 * gpus_per_node}Gi"
        check_options(image, vendor, shm_size, volume_size, port)
        # Pod host names are NAME-INDEX and must stay within 63 characters.
        job_name = dns_label(name or config.run.name, 63 - len(str(nodes)) - 1)
        files = manifests(
            config,
            resolved_yaml(config, "phalanx cluster k8s"),
            job_name,
            nodes,
            gpus_per_node,
            image,
            vendor,
            shm_size,
            volume_size,
            storage_class,
            port,
            max_requeues,
        )
        written = write(out.expanduser().absolute(), files, vendor)
        for local in local_paths(config):
            err.print(
                f"warning: {local} must exist at that path in the pods (in the image, or on the shared "
                f"volume under {RUNS_MOUNT})",
                soft_wrap=True,
            )
        report = {
            "dir": str(out.expanduser().absolute()),
            "job": job_name,
            "files": [p.name for p in written],
            "nodes": nodes,
            "ranks": nodes * gpus_per_node,
            "apply": f"kubectl apply -f {out}",
        }
        if json_out:
            print(json.dumps(report))
        else:
            print_table("kubernetes job", report)
