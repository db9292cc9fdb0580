from rollout.pipelines.tiny import main

main()
